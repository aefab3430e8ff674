"""raas.learn: the closed loop. A reference GRPO/DAPO trainer that owns a policy (torch), serves it with
llama.cpp, samples through a raas service and syncs its weights every step (:mod:`raas.learn.reference`,
``raas train``). It sits above the service layers it starts; :mod:`raas.trainer` stays a plain client."""
