"""k3-trace front end (click)."""
