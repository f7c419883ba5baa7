"""The gateway: the public API, session ownership and the draft -> verify round loop."""
