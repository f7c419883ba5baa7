"""One module per drafter kind; `base` holds the protocol they share."""
