"""The base of every error jaxtrain raises for bad user input; the command line prints these without a traceback."""


class UserInputError(ValueError):
    """A configuration, mesh, rule, data source or checkpoint that cannot work, with a message saying how to fix it."""
