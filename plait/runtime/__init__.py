"""Running ranks: launching them (torchrun, local agents), faults, throttled links and restarts."""
