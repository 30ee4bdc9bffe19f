"""Suite-wide settings: our own tests load plugins strictly, so a broken first-party pack fails loudly."""

import os

os.environ.setdefault("DATAFLEX_STRICT_PLUGINS", "1")
