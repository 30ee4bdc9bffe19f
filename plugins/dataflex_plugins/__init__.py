"""First-party method packs of dataflex-bus.

Each module here (``scorers``, and one per mechanism: ``select``, ``reweight``, ``mix``, ``replay``,
``allocate``) is one plugin, registered through the ``dataflex`` entry-point group exactly like a third-party
pack. The registration modules are import-light: they name ``module:Class`` targets under
:mod:`dataflex_plugins.methods`, which are imported (with torch) only when a component is built. Those classes
subclass the bases a third-party pack does (:mod:`dataflex_bus.components`: ``Scorer``; each actuator base from
its mechanism's module of :mod:`dataflex_bus.mechanisms`, re-exported by ``dataflex_bus.components``).
"""
