"""The emulator's server process: moto in server mode, patched where it falls short of what our stacks need.

`python -m trainstack.emulator [--port N]` runs it in the foreground (and records it where `--local` finds
it); `Emulator.start` (trainstack.emulator.endpoint) runs the same entry point with `--serve` as a child.
What is patched, and why, is listed in trainstack.emulator.endpoint's docstring: placeholders for resource
types moto's CloudFormation lacks, state machine names shortened as CloudFormation does, one Step Functions
backend for CloudFormation and the API, and (trainstack.emulator.events, .jobs) training and
processing jobs that really run, as local processes ($TRAINSTACK_EMULATOR_JOBS_DIR: their folders).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import time
from pathlib import Path

from trainstack.emulator import cloudformation, delivery, events, jobs
from trainstack.emulator.endpoint import (
    JOBS_DIR_ENV,
    STATE_FILE,
    Emulator,
    export_line,
    free_port,
    read_state,
    write_state,
)


def _placeholder_model() -> type:
    from moto.core.common_models import CloudFormationModel

    class Placeholder(CloudFormationModel):
        """An unimplemented resource type: never created, but has an id and answers GetAtt."""

        __module__ = "moto.cloudformation.placeholder"  # moto's model registry keys models by module

        def __init__(self, name: str, resource_type: str, region: str, account: str) -> None:
            self.name, self.resource_type, self.region, self.account = name, resource_type, region, account

        @property
        def physical_resource_id(self) -> str:
            return self.name

        @staticmethod
        def cloudformation_name_type() -> str:
            return ""

        @staticmethod
        def cloudformation_type() -> str:
            return "Placeholder"

        @classmethod
        def has_cfn_attr(cls, attr: str) -> bool:
            return True

        def get_cfn_attribute(self, attribute_name: str) -> str:
            service = self.resource_type.split("::")[1].lower()
            return f"arn:aws:{service}:{self.region}:{self.account}:placeholder/{self.name}"

        @classmethod
        def create_from_cloudformation_json(
            cls, resource_name, cloudformation_json, account_id, region_name, **kwargs
        ):
            return cls(
                resource_name, kwargs.get("ResourceType", "AWS::Unknown::Unknown"), region_name, account_id
            )

        @classmethod
        def update_from_cloudformation_json(
            cls, original_resource, new_resource_name, cloudformation_json, account_id, region_name
        ):
            return original_resource

        @classmethod
        def delete_from_cloudformation_json(cls, resource_name, cloudformation_json, account_id, region_name):
            return None

    return Placeholder


def serve(argv: list[str], jobs_dir: Path | None = None) -> None:
    from moto import server
    from moto.cloudformation import parsing

    placeholder = _placeholder_model()
    original = parsing.resource_class_from_type

    def resource_class_from_type(resource_type: str):
        found = original(resource_type)
        if found is None and resource_type not in parsing.NULL_MODELS:
            return placeholder
        return found

    parsing.resource_class_from_type = resource_class_from_type

    # moto names a state machine `<stack>-<logical id>-<suffix>` and then rejects names over 80
    # characters; CloudFormation shortens them. Keep the head and the random suffix, as it does.
    generate = parsing.generate_resource_name

    def generate_resource_name(resource_type: str, stack_name: str, logical_id: str) -> str:
        name = generate(resource_type, stack_name, logical_id)
        if resource_type == "AWS::StepFunctions::StateMachine" and len(name) > 80:
            name = name[:67] + "-" + name[-12:]
        return name

    parsing.generate_resource_name = generate_resource_name

    # With execution enabled, moto's Step Functions API answers from its interpreter's backend, but
    # its CloudFormation creates state machines in the other one: point CloudFormation at the same.
    from moto.stepfunctions import models as sfn_models
    from moto.stepfunctions.parser.models import stepfunctions_parser_backends

    sfn_models.stepfunctions_backends = stepfunctions_parser_backends
    isolate_definition_parses()
    # `npx cdk deploy` as documented: the change-set path, termination protection, failed creations.
    cloudformation.install()
    # Jobs that really run (trainstack.emulator.jobs), StopTrainingJob, Environment kept (.events).
    port = argv[argv.index("-p") + 1]
    jobs.configure_server(f"http://localhost:{port}", jobs_dir)
    # Each node runs in its own process group (so a stop reaches its workers): they would outlive the
    # server, so a SIGTERM (Emulator.stop, `trainstack emulator stop`) or an exit takes them along.
    atexit.register(jobs.kill_all)

    def stop_server(signum: int, frame: object) -> None:
        jobs.kill_all()
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop_server)
    events.install()
    # Job-state events delivered to the rules' targets and schedules run, by the server itself (.delivery).
    delivery.install(f"http://localhost:{port}", events.on_status_change)
    _log_error_bodies()
    server.main(argv)


def isolate_definition_parses() -> None:
    """Give each state machine definition parse its own query-language scopes.

    moto's ASL Preprocessor keeps its stack of QueryLanguage scopes in a class attribute, shared by
    every parse in the process: a parse that raises inside a JSONata state leaves its scopes behind, and
    two server threads parsing at once (a deploy creating state machines while a delivered event starts
    an execution) interleave theirs. Either way a later, valid JSONPath definition is refused
    ("Unsupported declaration in QueryLanguage=JSONPath block: "Variable"...") from then on: a CI run
    lost a whole documented walkthrough to it. Step Functions parses each definition on its own."""
    from moto.stepfunctions.parser.asl.parse.preprocessor import Preprocessor

    if getattr(Preprocessor, "_trainstack_isolated", False):
        return
    inherited_init = Preprocessor.__init__

    def __init__(self, *args: object, **kwargs: object) -> None:
        inherited_init(self, *args, **kwargs)
        self._query_language_per_scope = []

    Preprocessor.__init__ = __init__
    Preprocessor._trainstack_isolated = True


def _log_error_bodies() -> None:
    """Write the body of every 4xx/5xx answer to the log: the CDK CLI shows only 'XML parse error'
    when moto answers a CloudFormation call with another service's JSON error."""
    from moto import server

    run_simple = server.run_simple

    def logging_app(app):
        def wrapped(environ, start_response):
            captured = {}

            def capture(status, headers, exc_info=None):
                captured["status"] = status
                return start_response(status, headers, exc_info)

            body = list(app(environ, capture))
            if captured.get("status", "200")[0] in "45":
                text = b"".join(body)[:2000].decode("utf-8", "replace")
                print(
                    f"emulator: {environ.get('PATH_INFO')} -> {captured['status']}: {text}",
                    file=sys.stderr,
                    flush=True,
                )
            return body

        return wrapped

    server.run_simple = lambda host, port, app, *a, **k: run_simple(host, port, logging_app(app), *a, **k)


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(
        prog="python -m trainstack.emulator", description="run the local AWS emulator in the foreground"
    )
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        jobs_dir = os.environ.get(JOBS_DIR_ENV)  # Emulator.start says where its jobs go
        serve(["-H", "127.0.0.1", "-p", str(args.port)], Path(jobs_dir) if jobs_dir else None)
        return
    emulator = Emulator(port=args.port or free_port())
    # `kill PID` (SIGTERM) stops it like Ctrl-C: the server process and the state file go with it
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with emulator:
        write_state(emulator.endpoint, emulator.pid or 0, supervisor_pid=os.getpid())
        print(
            f"local AWS emulator on {emulator.endpoint} (state in {STATE_FILE}); Ctrl-C stops it", flush=True
        )
        print(export_line(emulator.env()), flush=True)
        try:
            while emulator._process is not None and emulator._process.poll() is None:
                time.sleep(1)
        except KeyboardInterrupt:
            pass
        finally:
            state = read_state()
            if state is not None and state.get("supervisor_pid") == os.getpid():
                STATE_FILE.unlink(missing_ok=True)  # only our own record
