"""The verl 0.9.1 integration: the ``dataflex_sync`` trainer mode and its tooling.

This package is the only place in dataflex-bus that imports verl, Ray or TransferQueue. The package
itself stays import-light on purpose: ``dataflex doctor`` and the verl entry point
(:mod:`dataflex_bus.verl.entry`) import submodules explicitly, so importing ``dataflex_bus.verl``
never pulls verl in.
"""

#: The verl versions whose private hook points (``_balance_batch``, ``_compute_advantage``,
#: ``_fetch_one_gen_batch``, ...) this adapter was written and tested against: [low, high).
TESTED_VERL = ("0.9.1", "0.9.2")
#: The name verl users pass as ``trainer.v1.trainer_mode``.
TRAINER_MODE = "dataflex_sync"
#: Every dataflex trainer mode and the verl mode whose trainer (and code paths) it runs.
TRAINER_MODES = {
    "dataflex_sync": "sync",
    "dataflex_colocate_async": "colocate_async",
    "dataflex_separate_async": "separate_async",
}
