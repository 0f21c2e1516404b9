"""k3-run front end (click)."""
