"""Host-neutral helpers that more than one host plugin needs (no host is imported here)."""
