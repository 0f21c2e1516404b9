"""Engine: generation loops, sampling, run reports; composes model, weights and state."""
