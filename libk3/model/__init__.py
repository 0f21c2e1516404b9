"""The K3 forward pass (spec K3-MODEL.md section 5): engine model and float64 reference."""
