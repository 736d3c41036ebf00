"""What the tests share: helpers, host specs, Hypothesis strategies, oracles."""
