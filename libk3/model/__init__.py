"""The K3 forward pass (model.md §5): engine model and float64 reference."""
