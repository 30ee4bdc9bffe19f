"""First-party method packs of dataflex-bus.

Each module here (``scorers``, ``select``, ``reweight``, ``mix``) is one plugin, registered through the
``dataflex`` entry-point group exactly like a third-party pack. The registration modules are
import-light: they name ``module:Class`` targets under :mod:`dataflex_plugins.methods`, which are
imported (with torch) only when a component is built.
"""
