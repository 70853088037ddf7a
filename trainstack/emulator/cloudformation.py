"""EMULATOR: moto's CloudFormation made to take the CDK CLI's default deploy, `npx cdk deploy`, as documented.

The CLI deploys through change sets unless told `--method=direct`. moto 5.2 falls short on that path in
ways that made the documented command fail on the emulator, or leave a stack that blocked the retry
(../shared/README.md section 7; issue 41):

- UpdateTerminationProtection is not implemented: moto answers with an HTML page, and the CLI, which
  calls it for every termination-protected stack (the Data stack), fails with "XML parse error:
  mismatched tags". Here it sets the stack's flag, which DescribeStacks then reports, as on AWS.
- A CREATE change set's stack was made without the region's exports, so the Launcher's
  `Fn::ImportValue` of the Data stack's outputs failed ("No export named ..."), and its own outputs
  were never computed nor exported. Here executing a change set builds the stack as CreateStack does
  (same stack id, so the CLI's monitoring finds it) and an UPDATE change set refreshes the exports.
- A creation that fails raised out of the API call: the CLI showed an XML parse error and the stack
  stayed in REVIEW_IN_PROGRESS or CREATE_IN_PROGRESS, where every retry failed (AlreadyExists, or a
  second stack of the same name). Here, as on AWS, the stack rolls back to ROLLBACK_COMPLETE with the
  cause in its events and StackStatusReason; the CLI prints it, and on the next `npx cdk deploy` deletes
  the stack and creates it again (its own handling of a failed creation).
- Change sets were found by name across the region, not on the stack named: the CLI, which names each
  stack's "cdk-deploy-change-set", deleted another stack's and then waited forever for its own to go.
  DeleteChangeSet of one that is not there crashed the server (the CLI deletes that name before each
  update), DescribeChangeSet of one answered ValidationError where the CLI waits for ChangeSetNotFound.
  Here they are the named stack's, the first does nothing and the second answers as AWS does.
- A CREATE change set for a name whose stack waits in REVIEW_IN_PROGRESS (a deploy interrupted after its
  change set was made) made a second stack of that name. Here it reuses that stack, as AWS does.

`install()` applies these in the server process (trainstack.emulator.server.serve); nothing AWS gets is
changed.
"""

from __future__ import annotations

from typing import Any

ROLLBACK_REASON = "The following resource(s) failed to create: {what}. Rollback requested by user."


def install() -> None:
    from moto.cloudformation import models, responses

    backend_class = models.CloudFormationBackend
    if getattr(backend_class, "_trainstack_change_sets", False):
        return
    backend_class._trainstack_change_sets = True
    backend_class.execute_change_set = _execute_change_set
    backend_class.delete_stack = _delete_stack
    inherited_create_change_set = backend_class.create_change_set

    def create_change_set(self: Any, stack_name: str, change_set_name: str, *args: Any, **kwargs: Any):
        waiting = _waiting_for_review(self, stack_name)
        if waiting is None or _change_set_type(args, kwargs) != "CREATE":
            return inherited_create_change_set(self, stack_name, change_set_name, *args, **kwargs)
        # Let moto make its placeholder stack, then keep the one already waiting in its place.
        change_set_id, made_id = inherited_create_change_set(
            self, stack_name, change_set_name, *args, **kwargs
        )
        made = self.stacks.pop(made_id)
        change_set = self.change_sets[change_set_id]
        change_set.stack, change_set.stack_id = waiting, waiting.stack_id
        waiting.events += made.events[-1:]
        return change_set_id, waiting.stack_id

    backend_class.create_change_set = create_change_set
    inherited_create_resources = models.Stack.create_resources

    def create_resources(self: Any) -> None:
        try:
            inherited_create_resources(self)
        except Exception as exc:  # noqa: BLE001 - any failure of a resource is the stack's failed creation
            _roll_back(self, exc)

    models.Stack.create_resources = create_resources
    responses.CloudFormationResponse.update_termination_protection = _update_termination_protection
    responses.CloudFormationResponse.delete_change_set = _delete_change_set
    responses.CloudFormationResponse.describe_change_set = _describe_change_set


def _change_set_not_found(change_set_name: str) -> Exception:
    from moto.cloudformation.exceptions import CloudFormationError

    class ChangeSetNotFound(CloudFormationError):
        code = "ChangeSetNotFoundException"  # the model's shape: sent as code ChangeSetNotFound, HTTP 404

    return ChangeSetNotFound(f"ChangeSet [{change_set_name}] does not exist")


def _change_set_type(args: tuple, kwargs: dict) -> str:
    # create_change_set(stack_name, change_set_name, template, parameters, description, change_set_type, ...)
    return kwargs.get("change_set_type") or (args[3] if len(args) > 3 else "CREATE")


def _waiting_for_review(backend: Any, stack_name: str) -> Any:
    return next(
        (s for s in backend.stacks.values() if s.name == stack_name and s.status == "REVIEW_IN_PROGRESS"),
        None,
    )


def _find_change_set(backend: Any, change_set_name: str, stack_name: str | None) -> Any:
    """The change set an API call names: by its ARN, or by its name on the stack it names (names are
    unique per stack, not per region: moto took the first of any stack's, and the CLI waited forever for
    its Launcher's change set to be deleted after deleting its Data stack's). None when there is none."""
    if change_set_name in backend.change_sets:  # an ARN
        return backend.change_sets[change_set_name]
    for change_set in reversed(backend.change_sets.values()):  # the newest, of a stack that is there
        if (
            change_set.change_set_name == change_set_name
            and change_set.stack_id in backend.stacks
            and stack_name in (None, change_set.stack_name, change_set.stack_id)
        ):
            return change_set
    return None


def _execute_change_set(self: Any, change_set_name: str, stack_name: str | None = None) -> None:
    """CloudFormationBackend.execute_change_set: as CreateStack / UpdateStack do it (see the docstring)."""
    from moto.cloudformation.exceptions import ValidationError
    from moto.cloudformation.models import Stack

    change_set = _find_change_set(self, change_set_name, stack_name)
    if change_set is None:
        raise ValidationError(stack_name or change_set_name)
    current = self.stacks[change_set.stack_id]
    if change_set.change_set_type == "CREATE":
        stack = current
        try:
            stack = Stack(
                stack_id=current.stack_id,
                name=current.name,
                template=change_set.template,
                parameters=change_set.parameters,
                account_id=self.account_id,
                region_name=self.region_name,
                notification_arns=change_set.notification_arns,
                tags=change_set.tags,
                role_arn=change_set.role_arn,
                cross_stack_resources=self.exports,
                enable_termination_protection=current.enable_termination_protection,
            )
            stack.events = current.events
            stack.creation_time = current.creation_time
            self.stacks[stack.stack_id] = change_set.stack = stack
            stack._add_stack_event("CREATE_IN_PROGRESS", resource_status_reason="User Initiated")
            self._validate_export_uniqueness(stack)
            for export in stack.exports:
                self.exports[export.name] = export
            stack.create_resources()  # a failure rolls back (install's create_resources)
        except Exception as exc:  # noqa: BLE001 - the template, an export: the creation failed
            _roll_back(stack, exc)
    else:
        stack = current
        parameters, tags = change_set.parameters, change_set.tags
        stack.update(change_set.template, change_set.role_arn, parameters=parameters, tags=tags)
        _withdraw_exports(self, stack)  # the outputs may have changed: export the new ones
        self._validate_export_uniqueness(stack)
        for export in stack.exports:
            self.exports[export.name] = export
    change_set.execution_status = "EXECUTE_COMPLETE"


def _roll_back(stack: Any, exc: Exception) -> None:
    """A creation that failed ends as on AWS: CREATE_FAILED (with the cause), what was made deleted,
    ROLLBACK_COMPLETE, its exports withdrawn."""
    from moto.cloudformation.models import cloudformation_backends

    cause = str(exc) or type(exc).__name__
    stack._add_stack_event("CREATE_FAILED", resource_status_reason=cause)
    stack._add_stack_event("ROLLBACK_IN_PROGRESS", resource_status_reason=ROLLBACK_REASON.format(what=cause))
    try:
        stack.resource_map.delete()
    except Exception:  # noqa: BLE001 - best effort, as a rollback that leaves a resource behind is on AWS
        pass
    from moto.cloudformation.parsing import OutputMap

    _withdraw_exports(cloudformation_backends[stack.account_id][stack.region_name], stack)
    # A rolled-back stack has no outputs (moto would resolve them, and so create resources, on every
    # DescribeStacks, failing each time as the creation did).
    stack.output_map = OutputMap(stack.resource_map, {}, stack.stack_id)
    stack._add_stack_event("ROLLBACK_COMPLETE")
    stack.status = "ROLLBACK_COMPLETE"
    stack.stack_status_reason = cause


def _delete_stack(self: Any, name_or_stack_id: str) -> None:
    """CloudFormationBackend.delete_stack, for a stack whose exports are not (or no longer) the region's:
    a rolled-back one, or one still in review. Its change sets go with it, as on AWS."""
    if name_or_stack_id not in self.stacks:
        for stack in list(self.stacks.values()):
            if stack.name == name_or_stack_id:
                _delete_stack(self, stack.stack_id)
        return
    stack = self.stacks.pop(name_or_stack_id)
    for change_set_id, change_set in list(self.change_sets.items()):  # a stack's change sets go with it
        if change_set.stack_id == stack.stack_id:
            del self.change_sets[change_set_id]
    stack.delete()
    self.deleted_stacks[stack.stack_id] = stack
    _withdraw_exports(self, stack)


def _withdraw_exports(backend: Any, stack: Any) -> None:
    for name, export in list(backend.exports.items()):
        if export.exporting_stack_id == stack.stack_id:
            backend.exports.pop(name)


def _delete_change_set(self: Any) -> Any:
    """CloudFormationResponse.delete_change_set: the named stack's; one that is not there is no error (the
    CLI deletes its change set's name before each deploy)."""
    from moto.core.responses import EmptyResult

    backend = self.cloudformation_backend
    found = _find_change_set(backend, self._get_param("ChangeSetName"), self._get_param("StackName"))
    if found is not None:
        backend.delete_change_set(change_set_name=found.change_set_id)
    return EmptyResult()


def _describe_change_set(self: Any) -> Any:
    """CloudFormationResponse.describe_change_set: the named stack's, or ChangeSetNotFound as on AWS (what
    the CLI waits for after deleting one)."""
    from moto.core.responses import ActionResult

    name = self._get_param("ChangeSetName")
    found = _find_change_set(self.cloudformation_backend, name, self._get_param("StackName"))
    if found is None:
        raise _change_set_not_found(name)
    return ActionResult(found)


def _update_termination_protection(self: Any) -> Any:
    """CloudFormationResponse.update_termination_protection (moto has none)."""
    from moto.core.responses import ActionResult

    stack = self.cloudformation_backend.get_stack(self._get_param("StackName"))
    stack.enable_termination_protection = self._get_bool_param("EnableTerminationProtection", False)
    return ActionResult({"StackId": stack.stack_id})
