"""k3-pack front end (click)."""
