"""What the attention templates are filled with, one module per backend (docs/DESIGN.md §5)."""
