"""Placeholder replaced by the demo implementation."""
import argparse


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pass


def main(args, settings) -> int:
    raise NotImplementedError
