"""Planners: one module per family turns a checked ``Variant`` into the plan its emitters print."""
