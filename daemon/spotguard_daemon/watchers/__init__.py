"""One module per platform event source; see base.py for the protocol."""
