"""What generated code imports at run time. Importing it has no side effects."""
