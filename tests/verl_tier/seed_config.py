"""The seed's quick-start overrides, exactly as a verl user types them (shared by the verl tests)."""

SEED = [
    "+dataflex.mechanism=select",
    "+dataflex.scorer.name=group_solve_rate",
    "+dataflex.scorer.params.success_threshold=0.5",
    "+dataflex.actuator.name=threshold_band",
    "+dataflex.actuator.params.low=0.2",
    "+dataflex.actuator.params.high=0.8",
    "+dataflex.warmup_step=0",
]
