"""The one table of gRPC status codes."""

import grpc
from ray.exceptions import ActorDiedError
from ray.serve._private.common import DeploymentID
from ray.serve.exceptions import (
    BackPressureError,
    DeploymentUnavailableError,
    RayServeException,
)

from engines.images import InvalidImage
from serve_app.errors import Code, Overloaded, code_for, code_name, message_for, replica_lost


def test_error_codes_follow_the_cause_chain() -> None:
    wrapped = RayServeException("upstream actor died")
    wrapped.__cause__ = ActorDiedError()
    assert code_for(wrapped) == Code.UNAVAILABLE
    assert code_for(InvalidImage("x")) == Code.INVALID_ARGUMENT
    assert code_for(Overloaded("full")) == Code.RESOURCE_EXHAUSTED
    assert code_for(BackPressureError(num_queued_requests=1, max_queued_requests=1)) == (
        Code.RESOURCE_EXHAUSTED
    )
    assert code_for(RuntimeError("boom")) == Code.INTERNAL


def test_the_engines_invalid_image_carries_the_code_the_table_gives_it() -> None:
    # Stages record `InvalidImage.code` directly; the table must agree with it.
    assert InvalidImage.code == code_for(InvalidImage("x")) == Code.INVALID_ARGUMENT


def test_codes_are_grpcs_and_named_as_grpc_names_them() -> None:
    for code in Code:
        assert grpc.StatusCode[code.name].value[0] == code
        assert code_name(int(code)) == code.name
    assert code_name(99) == "99"


def test_messages_are_one_line() -> None:
    assert message_for(InvalidImage("image is empty (0 bytes)")) == "image is empty (0 bytes)"
    assert message_for(Overloaded("queue is full")) == "queue is full"
    assert message_for(RuntimeError("boom\ntraceback...")) == "RuntimeError: boom"


def test_a_lost_replica_is_told_apart_from_an_unavailable_deployment() -> None:
    wrapped = RayServeException("upstream actor died")
    wrapped.__cause__ = ActorDiedError()
    assert replica_lost(wrapped) and replica_lost(ActorDiedError())
    gone = DeploymentUnavailableError(DeploymentID(name="Inference", app_name="raystream"))
    assert not replica_lost(gone) and code_for(gone) == Code.UNAVAILABLE
    assert not replica_lost(RuntimeError("boom"))
