"""ckptless.chaos: fault injectors, seeded schedules and the scenario runner."""
