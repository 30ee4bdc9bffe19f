"""Testing kit for plugin authors: realistic batches, in-process registration, quick shim runs."""
