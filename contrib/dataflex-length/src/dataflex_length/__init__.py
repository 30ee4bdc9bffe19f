"""dataflex-length: a response-length scorer for dataflex-bus (import-light; torch comes with the scorer)."""

__version__ = "0.1.0"
