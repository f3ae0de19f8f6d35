//! The protocol model checked exhaustively: the real protocol satisfies
//! every property for both store families, and each known-bad variant is
//! caught with a counterexample.

use idemq_model::{
    Flaws, InboxModel, Report, StoreKind, NO_DOUBLE_EFFECT, NO_FENCE_REUSE, NO_LOSS,
    NO_STALE_COMPLETION,
};

fn check(model: InboxModel) -> Report {
    let label = format!("{:?} {:?}", model.store, model.flaws);
    let report = model.check();
    println!("{label}: {report}");
    assert!(
        report.complete,
        "the check must visit every state: {report}"
    );
    report
}

fn find_violation(model: InboxModel) -> Report {
    let label = format!("{:?} {:?}", model.store, model.flaws);
    let report = model.find_violation();
    println!("{label}: {report}");
    report
}

fn assert_sound(report: &Report) {
    assert!(report.violations.is_empty(), "{report}");
    assert!(
        report.all_applied_reachable,
        "the model must be able to apply everything: {report}"
    );
}

/// Every store in `stores` with `flaws` on: the checker finds a
/// counterexample to `property`.
fn assert_caught(stores: &[StoreKind], flaws: Flaws, property: &str) {
    for &store in stores {
        let report = find_violation(InboxModel::new(store).with_flaws(flaws));
        assert!(report.violated(property), "{store:?}: {report}");
    }
}

const EVERY_STORE: [StoreKind; 4] = [
    StoreKind::Transactional,
    StoreKind::PartitionedTransactional,
    StoreKind::Lease,
    StoreKind::LeaseRecord,
];
const LEASE_STORES: [StoreKind; 2] = [StoreKind::Lease, StoreKind::LeaseRecord];

#[test]
fn transactional_store_keeps_every_property() {
    let report = check(InboxModel::new(StoreKind::Transactional));
    assert_sound(&report);
    assert!(report.unique_states > 1_000, "{report}");
}

#[test]
fn partitioned_transactional_store_keeps_every_property() {
    let report = check(InboxModel::new(StoreKind::PartitionedTransactional));
    assert_sound(&report);
    assert!(report.unique_states > 1_000, "{report}");
}

/// The candidate the partitioned inbox's design rejected: a look-up on a
/// snapshot taken before the lock was granted.
#[test]
fn partitioned_look_up_before_the_lock_is_caught() {
    let flaws = Flaws {
        look_before_lock: true,
        ..Flaws::default()
    };
    assert_caught(
        &[StoreKind::PartitionedTransactional],
        flaws,
        NO_DOUBLE_EFFECT,
    );
}

#[test]
fn lease_store_keeps_every_property() {
    let report = check(InboxModel::new(StoreKind::Lease));
    assert_sound(&report);
    assert!(report.unique_states > 1_000, "{report}");
}

#[test]
fn record_lease_store_keeps_every_property() {
    let report = check(InboxModel::new(StoreKind::LeaseRecord));
    assert_sound(&report);
    assert!(report.unique_states > 1_000, "{report}");
}

#[test]
fn record_lease_release_that_forgets_the_fence_is_caught() {
    let flaws = Flaws {
        release_forgets_fence: true,
        ..Flaws::default()
    };
    assert_caught(&[StoreKind::LeaseRecord], flaws, NO_FENCE_REUSE);
}

#[test]
fn check_then_insert_is_caught_in_every_store() {
    let flaws = Flaws {
        check_then_insert: true,
        ..Flaws::default()
    };
    assert_caught(&EVERY_STORE, flaws, NO_DOUBLE_EFFECT);
}

#[test]
fn ack_before_commit_is_caught_in_every_store() {
    let flaws = Flaws {
        ack_before_commit: true,
        ..Flaws::default()
    };
    assert_caught(&EVERY_STORE, flaws, NO_LOSS);
}

#[test]
fn completion_without_compare_and_set_is_caught() {
    let flaws = Flaws {
        complete_without_cas: true,
        ..Flaws::default()
    };
    assert_caught(&LEASE_STORES, flaws, NO_STALE_COMPLETION);
}

#[test]
fn downstream_write_without_fencing_is_caught() {
    let flaws = Flaws {
        write_without_fencing: true,
        ..Flaws::default()
    };
    assert_caught(&LEASE_STORES, flaws, NO_STALE_COMPLETION);
}

/// Larger bounds (about a minute in release). Run with `--ignored`.
#[test]
#[ignore = "larger bounds take minutes in debug; run with --release -- --ignored"]
fn every_store_keeps_every_property_with_larger_bounds() {
    let mut tx = InboxModel::new(StoreKind::Transactional);
    tx.messages = 3;
    tx.max_faults = 3;
    tx.max_duplicates = 2;
    assert_sound(&check(tx.clone()));
    tx.store = StoreKind::PartitionedTransactional;
    assert_sound(&check(tx));
    let mut lease = InboxModel::new(StoreKind::Lease);
    lease.max_faults = 2;
    lease.max_duplicates = 1;
    lease.max_premature_expiries = 2;
    assert_sound(&check(lease.clone()));
    lease.store = StoreKind::LeaseRecord;
    assert_sound(&check(lease));
}
