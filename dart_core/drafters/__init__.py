"""Draft heads that plug into the generation loop."""
