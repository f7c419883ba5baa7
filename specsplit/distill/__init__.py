"""`specsplit distill`: make a draft for a given target from the target's own continuations."""
