"""Independent reference implementations (torch only) of the original BFL forward passes, used as oracles."""
