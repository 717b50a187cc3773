"""radixmesh.lang: programs of gen, select and fork whose structure the runtime can see and reuse
(docs/frontend_language.md).

    from radixmesh.lang import function, gen, select, system, user, assistant, HttpBackend

    @function
    def qa(s, question):
        s += system("Answer briefly.")
        s += user(question)
        s += assistant(gen("answer", max_tokens=32, stop="\\n"))

    state = qa.run(question="What is 2 + 2?", backend=HttpBackend("http://127.0.0.1:8000"))
    print(state["answer"])
"""
from radixmesh.lang.backend import Backend, BackendError
from radixmesh.lang.backend_grpc import GrpcBackend
from radixmesh.lang.backend_http import HttpBackend
from radixmesh.lang.backend_openai import OpenAIBackend
from radixmesh.lang.choices import (greedy_token_selection, token_length_normalized,
                                    unconditional_likelihood_normalized)
from radixmesh.lang.ir import assistant, gen, select, system, user
from radixmesh.lang.program import Program, function, set_default_backend
from radixmesh.lang.state import ForkGroup, ProgramState


__all__ = ["function", "gen", "select", "system", "user", "assistant", "set_default_backend", "Program",
           "ProgramState", "ForkGroup", "Backend", "HttpBackend", "GrpcBackend", "OpenAIBackend", "BackendError",
           "token_length_normalized", "greedy_token_selection", "unconditional_likelihood_normalized"]
