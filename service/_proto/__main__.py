"""Build step: regenerate the gRPC stubs (``python -m relserve.service._proto``)."""

from . import generate

generate()
