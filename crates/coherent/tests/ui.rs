//! What must not compile: a client and a server that disagree on a compute service's types,
//! trait definitions a stub could not implement, and macro arguments that contradict each
//! other. Each case's compiler output is checked in beside it
//! (`TRYBUILD=overwrite cargo test -p coherent --test ui` rewrites them).

#[test]
fn mismatches_are_compile_errors() {
    let t = trybuild::TestCases::new();
    t.compile_fail("tests/ui/*.rs");
}
