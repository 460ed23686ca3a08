"""Emitters: expression printers and, per family, the template contexts of each backend."""
