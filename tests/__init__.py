"""k3 test suite."""
