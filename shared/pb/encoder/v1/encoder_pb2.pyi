from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EncodeRequest(_message.Message):
    __slots__ = ("image_bytes", "image_url", "min_pixels", "max_pixels")
    IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_URL_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    image_bytes: bytes
    image_url: str
    min_pixels: int
    max_pixels: int
    def __init__(self, image_bytes: _Optional[bytes] = ..., image_url: _Optional[str] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("image_bytes", "image_url")
    IMAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IMAGE_URL_FIELD_NUMBER: _ClassVar[int]
    image_bytes: bytes
    image_url: str
    def __init__(self, image_bytes: _Optional[bytes] = ..., image_url: _Optional[str] = ...) -> None: ...

class EncodeVideoRequest(_message.Message):
    __slots__ = ("frames", "min_pixels", "max_pixels")
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[Frame]
    min_pixels: int
    max_pixels: int
    def __init__(self, frames: _Optional[_Iterable[_Union[Frame, _Mapping]]] = ..., min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ...) -> None: ...

class EncodeReply(_message.Message):
    __slots__ = ("key", "grid_thw", "num_tokens", "cache_hit", "encoder_id")
    KEY_FIELD_NUMBER: _ClassVar[int]
    GRID_THW_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_HIT_FIELD_NUMBER: _ClassVar[int]
    ENCODER_ID_FIELD_NUMBER: _ClassVar[int]
    key: str
    grid_thw: _containers.RepeatedScalarFieldContainer[int]
    num_tokens: int
    cache_hit: bool
    encoder_id: str
    def __init__(self, key: _Optional[str] = ..., grid_thw: _Optional[_Iterable[int]] = ..., num_tokens: _Optional[int] = ..., cache_hit: _Optional[bool] = ..., encoder_id: _Optional[str] = ...) -> None: ...

class GetEmbeddingRequest(_message.Message):
    __slots__ = ("key",)
    KEY_FIELD_NUMBER: _ClassVar[int]
    key: str
    def __init__(self, key: _Optional[str] = ...) -> None: ...

class GetEmbeddingReply(_message.Message):
    __slots__ = ("blob",)
    BLOB_FIELD_NUMBER: _ClassVar[int]
    blob: bytes
    def __init__(self, blob: _Optional[bytes] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class EncoderStats(_message.Message):
    __slots__ = ("encoder_id", "media_encoded", "cache_hits", "coalesced", "forward_passes")
    ENCODER_ID_FIELD_NUMBER: _ClassVar[int]
    MEDIA_ENCODED_FIELD_NUMBER: _ClassVar[int]
    CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    COALESCED_FIELD_NUMBER: _ClassVar[int]
    FORWARD_PASSES_FIELD_NUMBER: _ClassVar[int]
    encoder_id: str
    media_encoded: int
    cache_hits: int
    coalesced: int
    forward_passes: int
    def __init__(self, encoder_id: _Optional[str] = ..., media_encoded: _Optional[int] = ..., cache_hits: _Optional[int] = ..., coalesced: _Optional[int] = ..., forward_passes: _Optional[int] = ...) -> None: ...
