"""Fast unit tests of one module each, mirroring the package's parts."""
