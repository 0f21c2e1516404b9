"""Shared pieces of the click front ends (``tools/k3-*``): one-line usage errors and
number option types (``group``), error mapping and JSON output (``support``). libk3 never
imports click; everything click-specific lives here or in a front end."""
