"""The package's version: a module at the bottom of the layers, imported by whatever records or prints it."""

__version__ = "0.1.0"
