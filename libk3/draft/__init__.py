"""The DSpark speculative-decoding draft (formats/model/dspark.md): its config, checkpoint,
forward pass, and the float64 reference it is checked against."""
