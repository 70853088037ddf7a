"""The training image: a prebuilt URI, a tag in this deployment's repository, or built from
training_image/."""

from __future__ import annotations

from pathlib import Path

from aws_cdk import IgnoreMode
from aws_cdk import aws_ecr as ecr
from aws_cdk import aws_ecr_assets as ecr_assets
from aws_cdk import aws_iam as iam
from constructs import Construct

from trainstack.aws.deployment import ImageSource

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = "training_image/Dockerfile"
# The build context is the repository root (the image copies the `trainstack` package for the
# recipe encoding). The root .dockerignore (owned with the Dockerfile) names what it sends; CDK
# reads it too, so synthesis never copies or hashes .venv or node_modules.


class TrainingImage(Construct):
    def __init__(
        self, scope: Construct, id: str, *, source: ImageSource, repository: ecr.IRepository
    ) -> None:
        super().__init__(scope, id)
        self._repository: ecr.IRepository | None = None
        self._external_uri: str | None = None
        if source.uri:
            self.image_uri = source.uri
            self._external_uri = source.uri
        elif source.repository_tag:
            self.image_uri = repository.repository_uri_for_tag(source.repository_tag)
            self._repository = repository
        else:
            asset = ecr_assets.DockerImageAsset(
                self,
                "Build",
                directory=str(REPO_ROOT),
                file=DOCKERFILE,
                build_args={"BASE_IMAGE": source.base_image_uri or ""},
                platform=ecr_assets.Platform.LINUX_AMD64,
                ignore_mode=IgnoreMode.DOCKER,
            )
            self.image_uri = asset.image_uri
            self._repository = asset.repository

    def grant_pull(self, role: iam.IRole) -> None:
        if self._repository is not None:
            self._repository.grant_pull(role)
            return
        assert self._external_uri is not None
        # A prebuilt image in another registry (for example an AWS Deep Learning Container): pull
        # rights on that one repository, read from its URI.
        registry, _, rest = self._external_uri.partition("/")
        parts = registry.split(".")
        if len(parts) >= 6 and parts[1] == "dkr" and parts[2] == "ecr":
            account, region = parts[0], parts[3]
            name = rest.split("@")[0].rsplit(":", 1)[0]
            role.add_to_principal_policy(
                iam.PolicyStatement(
                    actions=[
                        "ecr:BatchGetImage",
                        "ecr:GetDownloadUrlForLayer",
                        "ecr:BatchCheckLayerAvailability",
                    ],
                    resources=[f"arn:aws:ecr:{region}:{account}:repository/{name}"],
                )
            )
            role.add_to_principal_policy(
                iam.PolicyStatement(actions=["ecr:GetAuthorizationToken"], resources=["*"])
            )
