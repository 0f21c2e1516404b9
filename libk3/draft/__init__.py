"""The DSpark speculative-decoding draft (formats/dspark.md): its config, checkpoint,
forward pass, and the float64 reference it is checked against."""
