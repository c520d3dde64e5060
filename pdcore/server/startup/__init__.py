"""What a server checks before its engine starts: the `pdserve serve` flags parsed into
`ServerArgs` (`args_parser`), SGLang's common flags that need a feature or a plugin
(`sglang_flags`), flags for hardware this machine lacks, named device first (`hardware_first`),
and the checks that run before the model loads (`preflight`), so a bad command exits 2 naming
the flag to fix."""
