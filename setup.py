"""Build hook: metadata lives in pyproject.toml; this adds the protobuf step and the one C
extension (services/_copycheck.c, a fused copy and NaN/Inf check) to the build.

``build_protos`` runs first among the build's sub-commands, so a wheel (``pip wheel .``), a
regular install and an editable install (``pip install -e .``) all carry the generated
``shardline.services.pb`` modules without a separate protoc call (grpcio-tools is a build
requirement in pyproject.toml).
"""

import importlib.util
import os

from setuptools import Command, Extension, setup
from setuptools.command.build import build

HERE = os.path.dirname(os.path.abspath(__file__))


def _generator():
    spec = importlib.util.spec_from_file_location("shardline_protos_generate", os.path.join(HERE, "protos", "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class build_protos(Command):
    description = "generate services/pb/*_pb2*.py from protos/*.proto"
    user_options = []

    def initialize_options(self):
        self.editable_mode = False  # same output either way: the modules land in the source tree

    def finalize_options(self):
        pass

    def run(self):
        _generator().generate()

    def get_source_files(self):  # put protos/ and the generator into the sdist
        gen = _generator()
        return [os.path.relpath(p, HERE) for p in [*gen.proto_files(), gen.__file__]]

    def get_outputs(self):
        return []  # build_py copies the generated modules with the rest of the package

    def get_output_mapping(self):
        return {}


class build_with_protos(build):
    sub_commands = [("build_protos", None), *build.sub_commands]


# An editable install builds it in place (services/_copycheck*.so); tensor_checks falls back to
# torch and numpy where it is missing, and tests/unit/test_tensor_checks.py says so if it is.
copycheck = Extension("shardline.services._copycheck", ["services/_copycheck.c"], extra_compile_args=["-O3"])

setup(cmdclass={"build": build_with_protos, "build_protos": build_protos}, ext_modules=[copycheck])
