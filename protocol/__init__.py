"""tandem's wire protocol: message types, the codec and the socket location.

Imports nothing from tandem.daemon or tandem.client; see PROTOCOL.md.
"""

from .codec import ProtocolError, decode, encode, from_map, packb, unpackb
from .messages import *  # noqa: F401,F403 - the message types are the package's API
from .messages import PROTOCOL_VERSION, ErrorCode, FinishReason, Op
from .paths import default_socket_path, endpoint

__all__ = [
    "PROTOCOL_VERSION",
    "ErrorCode",
    "FinishReason",
    "Op",
    "ProtocolError",
    "decode",
    "encode",
    "from_map",
    "packb",
    "unpackb",
    "default_socket_path",
    "endpoint",
]
