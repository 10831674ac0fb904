"""The one table of gRPC status codes."""

from ray.exceptions import ActorDiedError
from ray.serve.exceptions import BackPressureError, RayServeException

from serve_app.errors import Code, InvalidImage, Overloaded, code_for, message_for


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


def test_messages_are_one_line() -> None:
    assert message_for(InvalidImage("image is empty (0 bytes)")) == "image is empty (0 bytes)"
    assert message_for(RuntimeError("boom\ntraceback...")) == "RuntimeError: boom"
