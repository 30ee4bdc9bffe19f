"""First-party method packs of dataflex-bus.

Each module here is one plugin, registered through the ``dataflex`` entry-point group exactly like a third-party
pack: ``scorers`` (the shared scorers) and one per mechanism, ``select``, ``reweight``, ``mix``, ``replay`` and
``allocate``, each registering its mechanism's actuators (``allocate`` its scorers too). The registration modules
are import-light: they name ``module:Class`` targets under :mod:`dataflex_plugins.methods`, which are imported
(with torch) only when a component is built. Those classes subclass the bases a third-party pack does
(``Scorer`` from :mod:`dataflex_bus.components`; each actuator base from its mechanism's module of
:mod:`dataflex_bus.mechanisms`). The packs run unchanged on every host (the CPU shim, verl, TRL).
"""
