"""The version, apart from the package root so the modules that stamp it on outputs import nothing above them."""

__version__ = "0.1.0"
