"""Stream a completion from a radixmesh replica over gRPC (the tokenizer is its entry point).

    radixmesh up --no-gateway            # prints: ... tokenizer gRPC at 127.0.0.1:PORT
    python examples/grpc_client.py --address 127.0.0.1:PORT "What is the capital of France?"
"""
from __future__ import annotations

import argparse
import os
import sys

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from protos.radixmesh.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt")
    parser.add_argument("--address", default="127.0.0.1:50051", help="the tokenizer's HOST:PORT")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    args = parser.parse_args()

    with grpc.insecure_channel(args.address) as channel:
        stub = tokenizer_pb2_grpc.TokenizerStub(channel)
        request = tokenizer_pb2.GenerateTextRequest(
            conversation=tokenizer_pb2.Conversation(messages=[
                tokenizer_pb2.ChatMessage(role="user", content=args.prompt)]),
            sampling=common_pb2.SamplingParams(max_new_tokens=args.max_tokens, temperature=args.temperature))
        usage = common_pb2.GenerateChunk()  # the latest chunk carries the request's usage
        try:
            for event in stub.Generate(request, timeout=300):
                kind = event.WhichOneof("event")
                if kind == "chunk":
                    print(event.chunk.text, end="", flush=True)
                    usage = event.chunk
                elif kind == "finish":
                    reason = common_pb2.FinishReason.Name(event.finish.finish_reason).removeprefix("FINISH_REASON_")
                    print(f"\n[{reason}; prompt {usage.prompt_tokens}, completion {usage.completion_tokens}, "
                          f"cached {usage.cached_tokens} tokens]")
                else:
                    print(f"\nerror {event.error.code}: {event.error.message}", file=sys.stderr)
                    return 1
        except grpc.RpcError as e:  # refused: bad input, queue full, not serving
            print(f"{e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
