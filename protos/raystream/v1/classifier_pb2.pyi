from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class EmbeddingDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FLOAT32: _ClassVar[EmbeddingDtype]
    FLOAT16: _ClassVar[EmbeddingDtype]

class Output(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OUTPUT_UNSPECIFIED: _ClassVar[Output]
    LABELS: _ClassVar[Output]
    EMBEDDING: _ClassVar[Output]
FLOAT32: EmbeddingDtype
FLOAT16: EmbeddingDtype
OUTPUT_UNSPECIFIED: Output
LABELS: Output
EMBEDDING: Output

class ClassifyRequest(_message.Message):
    __slots__ = ("request_id", "images", "top_k", "model", "timeout_ms", "pixels", "outputs", "embedding_dtype")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    IMAGES_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    PIXELS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DTYPE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    images: _containers.RepeatedScalarFieldContainer[bytes]
    top_k: int
    model: str
    timeout_ms: int
    pixels: Tensor
    outputs: _containers.RepeatedScalarFieldContainer[Output]
    embedding_dtype: EmbeddingDtype
    def __init__(self, request_id: _Optional[str] = ..., images: _Optional[_Iterable[bytes]] = ..., top_k: _Optional[int] = ..., model: _Optional[str] = ..., timeout_ms: _Optional[int] = ..., pixels: _Optional[_Union[Tensor, _Mapping]] = ..., outputs: _Optional[_Iterable[_Union[Output, str]]] = ..., embedding_dtype: _Optional[_Union[EmbeddingDtype, str]] = ...) -> None: ...

class Tensor(_message.Message):
    __slots__ = ("shape", "data")
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    shape: _containers.RepeatedScalarFieldContainer[int]
    data: bytes
    def __init__(self, shape: _Optional[_Iterable[int]] = ..., data: _Optional[bytes] = ...) -> None: ...

class ClassifyResponse(_message.Message):
    __slots__ = ("request_id", "results", "timing", "error")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    TIMING_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    results: _containers.RepeatedCompositeFieldContainer[ImageResult]
    timing: Timing
    error: Error
    def __init__(self, request_id: _Optional[str] = ..., results: _Optional[_Iterable[_Union[ImageResult, _Mapping]]] = ..., timing: _Optional[_Union[Timing, _Mapping]] = ..., error: _Optional[_Union[Error, _Mapping]] = ...) -> None: ...

class ImageResult(_message.Message):
    __slots__ = ("labels", "error", "embedding")
    LABELS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_FIELD_NUMBER: _ClassVar[int]
    labels: _containers.RepeatedCompositeFieldContainer[Label]
    error: Error
    embedding: Embedding
    def __init__(self, labels: _Optional[_Iterable[_Union[Label, _Mapping]]] = ..., error: _Optional[_Union[Error, _Mapping]] = ..., embedding: _Optional[_Union[Embedding, _Mapping]] = ...) -> None: ...

class Embedding(_message.Message):
    __slots__ = ("values", "values_fp16")
    VALUES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FP16_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    values_fp16: bytes
    def __init__(self, values: _Optional[_Iterable[float]] = ..., values_fp16: _Optional[bytes] = ...) -> None: ...

class Label(_message.Message):
    __slots__ = ("class_id", "name", "score")
    CLASS_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SCORE_FIELD_NUMBER: _ClassVar[int]
    class_id: int
    name: str
    score: float
    def __init__(self, class_id: _Optional[int] = ..., name: _Optional[str] = ..., score: _Optional[float] = ...) -> None: ...

class Error(_message.Message):
    __slots__ = ("code", "message")
    CODE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    code: int
    message: str
    def __init__(self, code: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("queue_ms", "preprocess_ms", "inference_ms", "postprocess_ms", "total_ms", "batch_size", "dispatch_ms")
    QUEUE_MS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESS_MS_FIELD_NUMBER: _ClassVar[int]
    INFERENCE_MS_FIELD_NUMBER: _ClassVar[int]
    POSTPROCESS_MS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    DISPATCH_MS_FIELD_NUMBER: _ClassVar[int]
    queue_ms: float
    preprocess_ms: float
    inference_ms: float
    postprocess_ms: float
    total_ms: float
    batch_size: int
    dispatch_ms: float
    def __init__(self, queue_ms: _Optional[float] = ..., preprocess_ms: _Optional[float] = ..., inference_ms: _Optional[float] = ..., postprocess_ms: _Optional[float] = ..., total_ms: _Optional[float] = ..., batch_size: _Optional[int] = ..., dispatch_ms: _Optional[float] = ...) -> None: ...

class ModelInfoRequest(_message.Message):
    __slots__ = ("model",)
    MODEL_FIELD_NUMBER: _ClassVar[int]
    model: str
    def __init__(self, model: _Optional[str] = ...) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("name", "version", "engine", "input_shape", "num_classes", "max_batch_size", "precision", "embedding_dim", "embedding_space", "route")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    ENGINE_FIELD_NUMBER: _ClassVar[int]
    INPUT_SHAPE_FIELD_NUMBER: _ClassVar[int]
    NUM_CLASSES_FIELD_NUMBER: _ClassVar[int]
    MAX_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    PRECISION_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_DIM_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_SPACE_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    name: str
    version: str
    engine: str
    input_shape: _containers.RepeatedScalarFieldContainer[int]
    num_classes: int
    max_batch_size: int
    precision: str
    embedding_dim: int
    embedding_space: str
    route: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, name: _Optional[str] = ..., version: _Optional[str] = ..., engine: _Optional[str] = ..., input_shape: _Optional[_Iterable[int]] = ..., num_classes: _Optional[int] = ..., max_batch_size: _Optional[int] = ..., precision: _Optional[str] = ..., embedding_dim: _Optional[int] = ..., embedding_space: _Optional[str] = ..., route: _Optional[_Iterable[str]] = ...) -> None: ...
