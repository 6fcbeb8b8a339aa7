"""What the plugin logged during a test, as one string."""


def logged(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)
