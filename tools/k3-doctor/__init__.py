"""k3-doctor front end (click)."""
