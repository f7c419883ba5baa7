"""The draft service: drafters and their per-session state."""
