"""How bytes move between peers: codecs, wire format, transports, averaging.

Imports neither mesh nor cli.
"""
